"""Test support: the quiescence check and the fault switch, over the engine's public and documented hooks;
the structured-output acceptance set (``extraction``)."""
