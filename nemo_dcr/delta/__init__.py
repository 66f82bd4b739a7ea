"""diff / apply / inspect over named tensors: the codec applied to a whole state."""
from nemo_dcr.delta.core import (DEFAULT_CHUNK, DEFAULT_LEVEL, ApplyReport, apply, diff, plan_entry, run_plan,
                                 verify_plan)

__all__ = ["DEFAULT_CHUNK", "DEFAULT_LEVEL", "ApplyReport", "apply", "diff", "plan_entry", "run_plan", "verify_plan"]
