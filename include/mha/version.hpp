// The library's version, kept equal to project(VERSION) in CMakeLists.txt.
#pragma once

#define MHA_VERSION_MAJOR 0
#define MHA_VERSION_MINOR 1
#define MHA_VERSION_PATCH 0
#define MHA_VERSION_STRING "0.1.0"
