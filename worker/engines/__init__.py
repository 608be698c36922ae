"""OCR engines behind one interface (``base.Engine``); ``build_engine`` picks one from settings."""
