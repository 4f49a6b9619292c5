import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Four real servers at once: run with `make soak` (SOAK_SYNCS set), not in `make test`.
collect_ignore = [] if os.environ.get("SOAK_SYNCS") else ["test_disk_fanout.py"]
# A fleet of real servers following a version store: `make soak-fleet` (FLEET_SYNCS set), not `make test`.
collect_ignore += [] if os.environ.get("FLEET_SYNCS") else ["test_soak_fleet.py"]
