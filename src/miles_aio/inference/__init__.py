"""Inference engines: the `InferenceEngine` protocol, the SGLang HTTP client and the embedded engine."""
