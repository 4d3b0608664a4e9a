"""Executors: how a StepPlan gets run on the device (now, or overlapped with host work)."""
