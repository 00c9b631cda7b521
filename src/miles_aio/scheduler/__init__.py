"""Submission scheduler: pure admission policy (`policy`) and the async rollout worker (`worker`)."""
