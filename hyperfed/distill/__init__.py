"""Dataset distillation, a library below the methods (MH-pFedHNDD, its plug-ins, FedDM, DESA).

:mod:`hyperfed.distill.losses` holds the losses, :mod:`hyperfed.distill.synthesis` the
distillation itself, :mod:`hyperfed.distill.component` the distilled set as a component a
server and a client hold (seed 003, §3.4-3.5):

* :func:`dm_loss` -- distribution matching (Eq. 4, per class as in Alg. 1 and DM):
  ``sum_c || mean_{x in B_c} f(x) - mean_{s in S_c} f(s) ||^2``.
* :func:`contrastive_loss` -- one function for SupCon (Eq. 5, the Contrastive Condensation loss
  L_CC) and UniCon (Eq. 8, the Reg loss L_Reg): anchors against a bank, positives = bank
  members of the anchor's class, the anchor's own entry excluded.
* :func:`universum` -- Mixup negatives ``u_j = lam x_j + (1 - lam) x_k`` (Eq. 8).
* :func:`distill_synthetic` -- ClientDatasetDistillation of Alg. 1 for a group of clients at
  once, with optional differential privacy (Table 6): DP-SGD on the images
  (:func:`dp_sgd_image_grad`, per-sample clipping with :func:`noisy_clipped_sum`) or noisy
  clipped per-class feature sums (``dp_mechanism``).
* :func:`merge_synthetic` -- the server's merge by label (Eq. 7).
* :func:`synthetic_objective` -- the local loss of Eq. 9 as a ``loss_fn`` for
  :meth:`ClientGroup.train`, with per-step synthetic batches from :func:`draw_batches`.

Readings of the paper (each is a choice the equations leave open):

* Features are the input of the model's last Linear layer (``return_features=True``), L2
  normalized before the dot products of Eq. 5 and 8 (as SupCon and UniCon's reference code
  do; raw 2048-d dot products over ``tau`` would saturate the softmax).
* Eq. 5 and Eq. 8 print a *sum* over anchors; we take the *mean* over anchors (SupCon /
  UniCon reference code). The sum is the mean times the number of anchors, i.e. a rescaled
  ``lambda``. Anchors with no positive in the bank are left out of the mean.
* Eq. 8's numerator ``exp(f(x_j).m / tau)`` with ``m`` the mean of the positives equals the
  mean over positives of ``exp``'s log-argument, so Eq. 8 is UniCon's loss exactly.
"""
