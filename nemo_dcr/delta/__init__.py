"""diff / apply / inspect over named tensors: the codec applied to a whole state.

``diff.py`` (encode a target against a base), ``plan.py`` (the typed apply plan: what applying
does to each tensor, decided before the first write), ``apply.py`` (decode, locate, check and
write each chunk; verify), ``changes.py`` (what ``on_change`` sees), ``stats.py`` (inspect).
The functions ``diff`` and ``apply`` shadow their modules' names as attributes of this package:
reach the modules with ``importlib.import_module("nemo_dcr.delta.apply")``.
"""
from nemo_dcr.delta.apply import (
    ApplyReport,
    Decoded,
    apply,
    apply_stream,
    remove_absent,
    remove_unnamed,
    run_plan,
    verify_plan,
)
from nemo_dcr.delta.diff import DEFAULT_CHUNK, DEFAULT_LEVEL, diff
from nemo_dcr.delta.plan import Action, Plan, plan_entry

__all__ = ["DEFAULT_CHUNK", "DEFAULT_LEVEL", "Action", "ApplyReport", "Decoded", "Plan", "apply", "apply_stream",
           "diff", "plan_entry", "remove_absent", "remove_unnamed", "run_plan", "verify_plan"]
