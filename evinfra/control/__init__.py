"""The control-plane process of one partition (see ``README.md`` beside this file)."""

from evinfra.control.lifecycle import RequestSink
from evinfra.control.service import Service, Submission

__all__ = ["RequestSink", "Service", "Submission"]
