"""What a network read may reach and for how long: public addresses only (``addresses``),
connections pinned to the addresses vetted (``pinned``), one deadline for a whole read
(``deadline``). Used by ``ocrq.net.fetch``, the producer's intake and the API's webhooks."""
