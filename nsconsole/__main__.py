from __future__ import annotations

from nsconsole.cli import main

raise SystemExit(main())
