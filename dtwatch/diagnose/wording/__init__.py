"""The words of a diagnosis: decisions hand facts here and get sentences back.

* :mod:`~dtwatch.diagnose.wording.phrases`: the shared phrases (ranks, sites, calls, exception texts) and the
  rules every sentence keeps: culprit first, then who waits where, then evidence.
* :mod:`~dtwatch.diagnose.wording.setup_words`: the setup warnings, one sentence per check, from its facts.
* :mod:`~dtwatch.diagnose.wording.straggler_words`: the straggler warning.
* :mod:`~dtwatch.diagnose.wording.idle_words`: ranks in no collective while others wait (unresponsive, stuck
  outside one).
"""
