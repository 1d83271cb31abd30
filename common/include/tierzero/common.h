// tierzero/common.h: the common module's public header.
//
// common is the base every other module builds on: Status/Expected errors,
// logging, RAII handles, durable (crash-safe) files, advisory file locks, byte units, the JSON configuration, and the
// capability probe. Include this header; the files under tierzero/common/ are
// its parts, split by concern so each reads on its own.
#pragma once

#include "tierzero/common/checks.h"
#include "tierzero/common/config.h"
#include "tierzero/common/durable_file.h"
#include "tierzero/common/dtype.h"
#include "tierzero/common/file_lock.h"
#include "tierzero/common/handles.h"
#include "tierzero/common/hash.h"
#include "tierzero/common/log.h"
#include "tierzero/common/probe.h"
#include "tierzero/common/state_format.h"
#include "tierzero/common/status.h"
#include "tierzero/common/sysinfo.h"
#include "tierzero/common/units.h"
