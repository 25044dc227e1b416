"""The rollout service: one replica serving one inference engine (vLLM or the reference hf engine) over gRPC."""
