"""Trace-driven simulator of recovery policies at paper scale (`elaswave simulate`)."""
