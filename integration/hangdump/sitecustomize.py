"""Imported at start-up by every Python process that the integration tests' torchrun and
Lightning runs start (``torchrun_util`` and ``test_lightning`` put this folder first on their
``PYTHONPATH``): on SIGUSR1 each prints the stacks of all its threads to stderr. The tests send
it to a hung run before killing it, so a hang in CI says where each rank and worker waited."""

import faulthandler
import signal

faulthandler.register(signal.SIGUSR1, all_threads=True)
