"""Capacity planner (`kvpager plan`): weights, KV cache per token, context and concurrency limits,
decode-speed bounds. Torch-free; see docs/kv-memory.md.
"""

from kvpager.planner.models import ModelFacts, load_model_facts
from kvpager.planner.plan import Plan, PlanOptions, make_plan

__all__ = ["ModelFacts", "Plan", "PlanOptions", "load_model_facts", "make_plan"]
