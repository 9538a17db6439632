"""Tensor and expert parallelism of the engine: the rank group and its collectives (``group``), how a rank's
slice of the model is cut (``layers``) and the rank processes under one server (``ranks``)."""
