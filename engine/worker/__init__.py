"""The device side of one engine step: input preparation, the forward context, the model runner."""
