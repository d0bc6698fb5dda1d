"""The commands beside the core: each reads what runs wrote (or the config's parser) and trains nothing itself.

- ``python -m fl_lightning.tools.compare RUN_DIR ...``: methods side by side over seeds (:mod:`.compare`);
- ``python -m fl_lightning.tools.membership_audit``: a membership-inference audit of a run (:mod:`.membership_audit`);
- ``python -m fl_lightning.tools.wandb_sync RUN_DIR``: a resumed offline W&B run uploaded as one (:mod:`.wandb_sync`);
- :mod:`.config_reference`: the config reference page, generated from the parser (the docs build calls it).

Their old paths (``python -m fl_lightning.tools.compare`` ...) still work, with a warning, until
:data:`fl_lightning.startup.moved.REMOVED_IN`.
"""
