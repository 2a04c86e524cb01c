"""The MoE-Spec workbench, installed as one package.

Its subpackages keep the design card's folders at the top of the repository (``capture/``,
``replay/``, ``analysis/``, ``app/``, ``policy/``, ...); pyproject.toml's ``package-dir`` maps each
to ``moe_spec.<folder>``, so an install adds this one name to site-packages (plus the console
scripts) and code imports ``moe_spec.capture``, never ``capture``. In a source checkout (this
folder beside pyproject.toml) the subpackages are found beside it, the same mapping, so the
working tree imports without an install too."""

from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "capture" / "__init__.py").is_file():
    __path__.append(str(_checkout))
