# forgelab's stubs for torchmonarch 0.6.0, which ships annotations but no py.typed marker.
# Only the names forgelab uses are declared: importing anything else fails the type check, so a new use of
# Monarch is typed here first (copy the signature from monarch's own source).
