"""Adapters that put kvc under inference engines (SGLang): imported lazily, never a dependency of kvc."""
