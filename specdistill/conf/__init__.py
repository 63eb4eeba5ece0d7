"""Hydra's configs, read from the installed package (`pkg://specdistill.conf`): groups target, drafter,
feature_server, trainer, data, layout, logger; schemas in specdistill/launch/config.py."""
