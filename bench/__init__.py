"""The benches, ``moe_spec.bench``: the scripts behind the figures of the README and
docs/results.md (``python bench/<script>.py ...``, each with ``--help``) and the helpers they
share (:mod:`~moe_spec.bench.pipeline`, :mod:`~moe_spec.bench.synthetic`).

A package of the one installed namespace like the design card's folders (pyproject.toml's
package-dir), the top layer: a bench imports any package and another bench as
``moe_spec.bench.<module>``, never by a bare name after a ``sys.path`` edit, and no package
imports a bench (tests/test_layering.py). ``python bench/<script>.py`` runs with the project
installed (``scripts/setup.sh``), as every command of the README does.
"""
