"""The words of a diagnosis: decisions hand facts here and get sentences back. No decision module builds a
sentence (``tests/test_layout.py`` counts them); nothing here decides. Changing how a kind of finding reads
touches its module here only.

* :mod:`~dtwatch.diagnose.wording.phrases`: the shared phrases (ranks, sites, calls, exception texts), the
  sentence of a step-order parting, and the rules every sentence keeps: culprit first, then who waits where, then
  evidence.
* :mod:`~dtwatch.diagnose.wording.waiting_words`: who waits on the culprits, and where (every stall ends with it).
* :mod:`~dtwatch.diagnose.wording.compare_words`: ranks that all issued something: desyncs, a point-to-point
  deadlock, ranks out of step, extra or skipped rank-conditional calls, collectives that do not complete.
* :mod:`~dtwatch.diagnose.wording.loops_words`: ranks that left a loop the others are still in, or issued fewer
  calls over the same steps.
* :mod:`~dtwatch.diagnose.wording.order_words`: what a program-order finding adds at a stall; a silent desync seen
  earlier whose records are gone.
* :mod:`~dtwatch.diagnose.wording.mismatch_words`: ranks at one call with different arguments.
* :mod:`~dtwatch.diagnose.wording.ending_words`: how one rank ended (exception, exit status, signal, nothing
  recorded); :mod:`~dtwatch.diagnose.wording.ended_words`: the findings about ranks that ended.
* :mod:`~dtwatch.diagnose.wording.idle_words`: ranks in no collective while others wait (unresponsive, stuck
  outside one).
* :mod:`~dtwatch.diagnose.wording.straggler_words`: the straggler warning, and why a look names nobody.
* :mod:`~dtwatch.diagnose.wording.loader_words`: DataLoaders of different lengths across ranks.
* :mod:`~dtwatch.diagnose.wording.setup_words`: the setup warnings, one sentence per check.
* :mod:`~dtwatch.diagnose.wording.dump_words`: what makes a file no Flight Recorder dump.
"""
