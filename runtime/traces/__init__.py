"""Traces, pure: their formats and their reduction to the tuner's workload (``formats``). Reading files and S3
objects is the adapter ``runtime.tracking.traces``."""
