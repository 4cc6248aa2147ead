"""The gRPC edge: conversions between the model and the wire, and between SDK errors and gRPC statuses."""
