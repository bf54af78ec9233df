"""Integrations with other libraries; each is optional and imported explicitly
(``import flashtile.integrations.transformers``)."""
