#!/usr/bin/env bash
# The comparisons behind README "Results": every method of one table on the same config.
#   benchmarks/sweep.sh GROUP OUT_DIR [PARALLEL] [--set k=v ...]
# GROUP: mh_homo | mh_hetero | mh_dd | pfedkt | pfedes_homo | pfedes_hetero | dfedhp_ring | dfedhp_full
# Each run lands in OUT_DIR/<label>; `hyperfed report OUT_DIR/*` prints the table.
# Extra --set arguments apply to every run (e.g. --set device=cuda --set rounds=50).
set -euo pipefail
group=$1 out=$2 parallel=${3:-1}
shift 2; [ $# -gt 0 ] && shift
extra=("$@")
mh_methods="local fedavg pfedhn mh_pfedhn mh_pfedhng mh_pfedhngd"
es_methods="pfedes local lg_fedavg fedproto fml fedkd fd"
case $group in
  mh_homo)   cfg=configs/seed000/fmnist_homo.toml
             runs=$(for m in $mh_methods; do echo "$m algorithm.name=$m"; done) ;;
  mh_hetero) cfg=configs/seed000/fmnist_hetero.toml
             runs=$(for m in $mh_methods; do echo "$m algorithm.name=$m"; done) ;;
  mh_dd)     cfg=configs/mh_pfedhndd_fmnist.toml  # seed 003: Tables 1, 3 and 5 in one
             runs=$(for m in local fedavg fedavg_dd pfedhn pfedhn_dd mh_pfedhn mh_pfedhndd; do
                 echo "$m algorithm.name=$m"; done
               echo "no_cc algorithm.mh_pfedhndd.lambda_cc=0"
               echo "no_universum algorithm.mh_pfedhndd.universum=false") ;;
  pfedkt)    cfg=configs/pfedkt_fmnist.toml
             runs=$(printf '%s\n' "pfedkt algorithm.name=pfedkt" "fedavg algorithm.name=fedavg" \
               "local algorithm.name=local" \
               "ablation_A algorithm.use_hypernet=false algorithm.use_contrastive=false" \
               "ablation_B algorithm.use_hypernet=true algorithm.use_contrastive=false" \
               "ablation_C algorithm.use_hypernet=false algorithm.use_contrastive=true") ;;
  pfedes_homo|pfedes_hetero)
             cfg=configs/${group/pfedes_/pfedes_fmnist_}.toml
             runs=$(for m in $es_methods; do
               if [ "$m" = pfedes ]; then echo "pfedes algorithm.name=pfedes"
               elif [ "$m" = lg_fedavg ] && [ "$group" = pfedes_hetero ]; then
                 # heterogeneous CNN-1..5 share only their classifier layer
                 echo "$m algorithm={name=\"$m\",global_layers=\"classifier\"}"
               else echo "$m algorithm={name=\"$m\"}"; fi; done) ;;
  dfedhp_ring|dfedhp_full)
             cfg=configs/${group/dfedhp_/dfedhp_fmnist_}.toml topology=${group#dfedhp_}
             # the baselines replace the [algorithm] table: it holds DFedHP-only keys
             runs=$(printf '%s\n' "dfedhp algorithm.name=dfedhp" \
               "dfedavg algorithm={name=\"dfedavg\",topology=\"$topology\"}" \
               "dfedalt algorithm={name=\"dfedalt\",topology=\"$topology\"}" \
               "local algorithm={name=\"local\"}") ;;
  *) echo "unknown group '$group' (mh_homo, mh_hetero, mh_dd, pfedkt, pfedes_homo, pfedes_hetero," \
          "dfedhp_ring, dfedhp_full)" >&2
     exit 2 ;;
esac
mkdir -p "$out"
while read -r label sets; do
  while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n || true; done
  args=(); for s in $sets; do args+=(--set "$s"); done
  ( hyperfed run --config "$cfg" "${args[@]}" "${extra[@]}" --out "$out/$label" \
      >"$out/$label.log" 2>&1 && echo "done $label" || echo "FAILED $label (see $out/$label.log)" ) &
done <<< "$runs"
wait
hyperfed report "$out"/*/ --out "$out/report" | tee "$out/report.txt" || true
