"""Framework adapters: thin drivers of the watch() step protocol where a framework owns the loop.

``torchdebug.integrations.lightning.TorchDebugCallback`` (extra ``torchdebug[lightning]``) and
``torchdebug.integrations.transformers.TorchDebugCallback`` (extra ``torchdebug[transformers]``);
each module imports its framework lazily and names the extra when it is missing.
"""
