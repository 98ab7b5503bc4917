"""Small utilities shared by every package; none imports anything of kvtier outside this package.

* :mod:`~kvtier.util.fields` -- the domain of every configuration field, checked once with one-line errors;
* :mod:`~kvtier.util.helperthread` -- one worker thread per purpose, started on first use;
* :mod:`~kvtier.util.ratelog` -- logging of bad input that may repeat: counted always, logged at a bounded rate;
* :mod:`~kvtier.util.gcpause` -- garbage-collector pauses of a long-running process, measured and kept short;
* :mod:`~kvtier.util.lazy` -- lazy re-exports for package facades;
* :mod:`~kvtier.util.infile` -- a file read whole, in bounded memory and never waited on;
* :mod:`~kvtier.util.outpath` -- a file written later, checked when the command starts;
* :mod:`~kvtier.util.signals` -- signal handlers for the length of a block (the stop signals' clean stop).
"""
