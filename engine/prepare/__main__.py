import sys

from engine.prepare.command import main

sys.exit(main())
