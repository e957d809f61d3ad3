"""The pure core (no torch): the module DAG, rank placement, the action IR, schedules and the simulator.

Everything here is plain Python data and functions of it, so any layout and schedule can be
built, checked and timed without processes or devices.
"""
