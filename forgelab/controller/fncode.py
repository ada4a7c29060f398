"""Deprecated module path: a function's code as data is `forgelab.controller.function_code` (renamed in issue
#38; this alias goes in the next release). Importing it gives that module, with a DeprecationWarning; records
and pickles that name `forgelab.controller.fncode` still load."""
from forgelab.lazy import deprecated_module

deprecated_module(__name__, "forgelab.controller.function_code")
