"""What decoding costs on this machine, measured: a draft step and a target forward by tokens fed (model: CostModel,
the step and tree tables the policies and shapes price with), and the tables by batch size that the batch controller
prices with (batch). The decoders' clock is decode.clock."""

from decode.costs.batch import BatchCosts, batch_costs, table_sizes
from decode.costs.model import CostModel, head_cost, measure_costs, tree_costs

__all__ = ["BatchCosts", "CostModel", "batch_costs", "head_cost", "measure_costs", "table_sizes", "tree_costs"]
