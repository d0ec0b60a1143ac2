"""``dtwatch lint``: the static check for collectives that only some ranks reach."""
