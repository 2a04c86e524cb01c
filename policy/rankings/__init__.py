"""Expert rankings, one module each, behind one registry (:mod:`policy.rankings.base`).

Runtime rankings need only the tree's router scores (and offline calibration statistics): they
work inside verification passes (capture's online mode, closed-loop replay) as well as in
open-loop replay. Offline rankings need every expert's output and are upper bounds.

:data:`policy.index.RANKINGS` lists them and names each one's module; :func:`get` imports it on
first use. To add one: write ``policy/rankings/<name>.py`` with a ``@register``-ed
:class:`Ranking` subclass and add its line to :data:`policy.index.RANKINGS`.
"""

from moe_spec.policy.rankings.base import REGISTRY, Ranking, RankingError, get, help_text, names, register

__all__ = ["REGISTRY", "Ranking", "RankingError", "get", "help_text", "names", "register"]
