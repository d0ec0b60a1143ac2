"""End-to-end scenarios: minimal 4-rank gloo training scripts that hang, crash or stay healthy on purpose.

``catalog.py`` lists them with what really happened (the truth); ``benchmarks/scenarios.py`` runs them
under ``dtwatch run`` and compares the diagnosis with the truth; ``tests/incidents/`` keeps one captured
fixture per scenario for the fast replay tests (``tests/test_incidents.py``).
"""
