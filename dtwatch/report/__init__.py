"""What a person reads after the fact: the text report, the timeline, bundles, ``dtwatch analyze``
and incident capture."""
