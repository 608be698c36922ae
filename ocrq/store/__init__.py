"""The durable store: one protocol and its kinds, S3 (``storage``) and the local store on one
host (``sqlite_store`` over ``local_store``'s files), every path checked against the store's
root (``ocrq.keys.check_store_path``). It knows paths and bytes, not jobs."""
