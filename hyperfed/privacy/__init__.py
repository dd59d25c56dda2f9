"""Privacy tools: differential-privacy accounting (:mod:`hyperfed.privacy.accounting`),
gradient inversion (:mod:`hyperfed.privacy.inversion`) and the ``hyperfed attack``
experiment built on it (:mod:`hyperfed.privacy.attack`)."""
