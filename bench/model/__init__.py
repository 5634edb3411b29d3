"""PREDICTIONS of burstcu.plan's cost model, and its pick checked against measurements."""
