"""Deprecated module path: the memory planner is `forgelab.memory_plan` (renamed in issue #38; this alias goes in
the next release). Importing `forgelab.plan` gives that module, with a DeprecationWarning."""
from forgelab.lazy import deprecated_module

deprecated_module(__name__, "forgelab.memory_plan")
