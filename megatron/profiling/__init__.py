"""Cost-model profiler: per-layer time and activation memory over a shape grid, written in
the planner's cost-model format (`megatron.planner.cost.cost_model`). CLI: `profile_model`."""
import os

# The CPU peak-memory pass starts torch.profiler once per shape; kineto prints a banner at
# each start unless its log level is above the banner's (takes effect if set before torch loads).
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
