"""Helpers for testing forgelab code: in-process fakes of the run's parts (`forgelab.testing.fakes`)."""
