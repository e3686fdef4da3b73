"""Shared capacity mode: batch on an endpoint that also serves online traffic (docs/shared-capacity.md).

- ``mode``: who decides the mode (the deployment, per endpoint) and shared mode's settings;
- ``signals``: an endpoint's load from its ``/metrics`` page (vLLM's names or the router's);
- ``policy``: the control law, pure: the next batch limit from the signals;
- ``limiter``: permits with a changing limit, earliest deadline first, and preemption;
- ``controller``: one per endpoint per process; reads the page, applies the law.
"""
