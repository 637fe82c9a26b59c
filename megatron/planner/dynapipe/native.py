"""The planners' C++ inner loops (megatron/planner/dynapipe/partition.cpp, built by setup.py), or None.

Without the build (a source checkout without `pip install -e .`) every caller runs its numpy or
Python version instead: same plans, slower. One import point, so the check is made once."""
try:
    from megatron.planner.dynapipe import partition_cpp as cpp
except ImportError:
    cpp = None
