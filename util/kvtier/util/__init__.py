"""Small utilities shared by every package; each module stands alone and imports nothing else of kvtier.

* :mod:`~kvtier.util.fields` -- the domain of every configuration field, checked once with one-line errors;
* :mod:`~kvtier.util.helperthread` -- a daemon helper thread that reports its failure instead of dying silently;
* :mod:`~kvtier.util.ratelog` -- rate-limited logging of repeated warnings;
* :mod:`~kvtier.util.gcpause` -- pauses the cyclic garbage collector over long allocation bursts.
"""
