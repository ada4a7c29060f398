"""torchtitan (0.3.0), as forgelab uses it: forgelab's own stubs of the pieces it imports (torchtitan ships no type
information). Only those names are here; a name forgelab starts to use is added with its signature."""
