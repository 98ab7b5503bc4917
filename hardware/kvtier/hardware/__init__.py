"""Models of serving hardware, shared by the simulated engines and the router's cost models.

* :mod:`~kvtier.hardware.links` -- named links (GPU <-> host, storage) with their bandwidths and sources;
* :mod:`~kvtier.hardware.latency` -- prefill and decode latency fits per model preset, and the transfer model.

A router that prices a route in time and a simulator that charges it must use one model, or the simulator would
grade the router against a different machine; so both import it from here.
"""
