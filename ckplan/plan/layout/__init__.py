"""Layouts of N GPUs (`ckplan plan`): the space of layouts, lower bounds, and the search.

space   every (tp, sp, pp and its split, v, cp, dp, ep, zero, micro-batch) Megatron-LM runs
bounds  lower bounds on a layout's memory and step time from cached parts
search  the fastest layouts, each with its best plan, and why the others were rejected
"""

__all__ = ["bounds", "search", "space"]
