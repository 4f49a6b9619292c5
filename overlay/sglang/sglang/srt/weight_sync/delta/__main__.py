import sys

from sglang.srt.weight_sync.delta.tools import main

sys.exit(main())
