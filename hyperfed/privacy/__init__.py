"""Privacy mechanics the methods and apps call: differential privacy (accounting,
:mod:`hyperfed.privacy.accounting`, and DP-SGD, :mod:`hyperfed.privacy.dp_sgd`) and gradient
inversion (:mod:`hyperfed.privacy.inversion`). The ``hyperfed attack`` experiment built on the
inversion is an app: :mod:`hyperfed.attack`."""
