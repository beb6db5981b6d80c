"""Plans: strategies parsed, applied to a model's chain and replayed; the search over them."""

from ckplan.plan.evaluate import (
    DEFAULT_SLOTS,
    FlopCount,
    Plan,
    evaluate,
    in_flight_microbatches,
)
from ckplan.plan.layer_chain import layer_chain, stage_names
from ckplan.plan.strategies import FORMULAS, STRATEGY_HELP, Strategy, StrategyError, parse_strategy

__all__ = [
    "DEFAULT_SLOTS",
    "FORMULAS",
    "STRATEGY_HELP",
    "FlopCount",
    "Plan",
    "Strategy",
    "StrategyError",
    "evaluate",
    "in_flight_microbatches",
    "layer_chain",
    "parse_strategy",
    "stage_names",
]
