// Package helm holds the tests of Narwhal's Helm chart (deploy/helm/narwhal).
// It is a module of its own, so that the Helm and Kubernetes libraries never
// enter the main module (docs/kubernetes.md, "What is tested here").
package helm

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	"helm.sh/helm/v3/pkg/releaseutil"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"
)

const (
	chartDir  = "narwhal"
	namespace = "llm"
	release   = "prod"
)

// narwhalBin is the narwhal binary of this commit, built by TestMain.
var narwhalBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "narwhal-chart-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	narwhalBin = filepath.Join(dir, "narwhal")
	build := exec.Command("go", "build", "-o", narwhalBin, "./cmd/narwhal")
	build.Dir = filepath.Join("..", "..")
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build narwhal: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// valueSets are the values the chart is rendered with: its defaults, and
// each example values file.
func valueSets(t *testing.T) map[string]map[string]any {
	t.Helper()
	sets := map[string]map[string]any{"defaults": {}}
	files, err := filepath.Glob(filepath.Join(chartDir, "examples", "*.yaml"))
	if err != nil || len(files) < 2 {
		t.Fatalf("examples: %v %v", files, err)
	}
	for _, f := range files {
		v, err := chartutil.ReadValuesFile(f)
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		sets[filepath.Base(f)] = v
	}
	return sets
}

func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	c, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// render renders the chart with vals (schema-checked, as helm install
// does) and returns its manifests by "template#index".
func render(t *testing.T, c *chart.Chart, vals map[string]any) (map[string]string, error) {
	t.Helper()
	rv, err := chartutil.ToRenderValues(c, vals, chartutil.ReleaseOptions{Name: release, Namespace: namespace, IsInstall: true},
		chartutil.DefaultCapabilities)
	if err != nil {
		return nil, err
	}
	files, err := engine.Render(c, rv)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for name, body := range files {
		if !strings.HasSuffix(name, ".yaml") {
			continue
		}
		for k, doc := range releaseutil.SplitManifests(body) {
			if strings.TrimSpace(doc) != "" {
				out[name+"#"+k] = doc
			}
		}
	}
	return out, nil
}

// object is one rendered object decoded strictly into its API type.
type object struct {
	kind, name string
	obj        any
}

// decodeStrict decodes doc into the API type of its kind; an unknown
// field, an unknown kind or a wrong type fails.
func decodeStrict(doc string) (object, error) {
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name string `json:"name"`
		} `json:"metadata"`
	}
	if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
		return object{}, err
	}
	var obj any
	switch head.APIVersion + " " + head.Kind {
	case "v1 ConfigMap":
		obj = &corev1.ConfigMap{}
	case "v1 Service":
		obj = &corev1.Service{}
	case "v1 ServiceAccount":
		obj = &corev1.ServiceAccount{}
	case "apps/v1 Deployment":
		obj = &appsv1.Deployment{}
	case "apps/v1 StatefulSet":
		obj = &appsv1.StatefulSet{}
	case "batch/v1 Job":
		obj = &batchv1.Job{}
	case "policy/v1 PodDisruptionBudget":
		obj = &policyv1.PodDisruptionBudget{}
	case "autoscaling/v2 HorizontalPodAutoscaler":
		obj = &autoscalingv2.HorizontalPodAutoscaler{}
	case "networking.k8s.io/v1 NetworkPolicy":
		obj = &networkingv1.NetworkPolicy{}
	case "rbac.authorization.k8s.io/v1 ClusterRoleBinding":
		obj = &rbacv1.ClusterRoleBinding{}
	case "monitoring.coreos.com/v1 ServiceMonitor":
		obj = &monitoringv1.ServiceMonitor{}
	case "monitoring.coreos.com/v1 PodMonitor":
		obj = &monitoringv1.PodMonitor{}
	case "monitoring.coreos.com/v1 PrometheusRule":
		obj = &monitoringv1.PrometheusRule{}
	default:
		return object{}, fmt.Errorf("kind %s %s: no API type known to this test", head.APIVersion, head.Kind)
	}
	if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
		return object{}, fmt.Errorf("%s %s: %w", head.Kind, head.Metadata.Name, err)
	}
	return object{kind: head.Kind, name: head.Metadata.Name, obj: obj}, nil
}

// renderObjects renders vals and decodes every object strictly.
func renderObjects(t *testing.T, c *chart.Chart, vals map[string]any) []object {
	t.Helper()
	docs, err := render(t, c, vals)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	keys := make([]string, 0, len(docs))
	for k := range docs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var objs []object
	for _, k := range keys {
		o, err := decodeStrict(docs[k])
		if err != nil {
			t.Errorf("%s: %v\n%s", k, err, docs[k])
			continue
		}
		objs = append(objs, o)
	}
	return objs
}

// TestChartRendersStrictTypes proves that the chart renders with its
// defaults and each example values file, and that every object decodes
// strictly into its k8s.io/api or prometheus-operator type.
func TestChartRendersStrictTypes(t *testing.T) {
	c := loadChart(t)
	for name, vals := range valueSets(t) {
		t.Run(name, func(t *testing.T) {
			objs := renderObjects(t, c, vals)
			kinds := map[string]int{}
			for _, o := range objs {
				kinds[o.kind]++
			}
			for _, k := range []string{"StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "NetworkPolicy"} {
				if kinds[k] == 0 {
					t.Errorf("no %s rendered (%v)", k, kinds)
				}
			}
		})
	}
}

// podSpecs returns the pod templates of the workloads in objs, by name.
func podSpecs(objs []object) map[string]*corev1.PodSpec {
	out := map[string]*corev1.PodSpec{}
	for _, o := range objs {
		switch w := o.obj.(type) {
		case *appsv1.Deployment:
			out[o.kind+"/"+o.name] = &w.Spec.Template.Spec
		case *appsv1.StatefulSet:
			out[o.kind+"/"+o.name] = &w.Spec.Template.Spec
		case *batchv1.Job:
			out[o.kind+"/"+o.name] = &w.Spec.Template.Spec
		}
	}
	return out
}

// pendingCheckArgs are narwhal subcommands that the chart runs but whose
// --check-args this commit's binary does not have yet.
var pendingCheckArgs = map[string]string{
	"bus setup": "narwhal bus setup acts on a live bus; it has no --check-args",
}

var envRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// TestChartCommandsCheckArgs proves that every narwhal container's command
// and flags, with its environment, are accepted by the narwhal binary of
// this commit (its hidden --check-args: its own flag parsing and config
// validation). The files it mounts are made in a scratch directory: a
// ConfigMap's rendered data, and a placeholder for each Secret's files.
func TestChartCommandsCheckArgs(t *testing.T) {
	c := loadChart(t)
	checked := 0
	for name, vals := range valueSets(t) {
		objs := renderObjects(t, c, vals)
		configMaps := map[string]*corev1.ConfigMap{}
		for _, o := range objs {
			if cm, ok := o.obj.(*corev1.ConfigMap); ok {
				configMaps[cm.Name] = cm
			}
		}
		for wname, spec := range podSpecs(objs) {
			for _, ctr := range spec.Containers {
				if len(ctr.Command) == 0 || ctr.Command[0] != "narwhal" {
					continue
				}
				sub := strings.Join(ctr.Args[:min(2, len(ctr.Args))], " ")
				if why, ok := pendingCheckArgs[sub]; ok {
					t.Logf("%s %s %s: not checked: %s", name, wname, sub, why)
					continue
				}
				root := t.TempDir()
				mounts := map[string]string{}
				for _, m := range ctr.VolumeMounts {
					dir := filepath.Join(root, strings.ReplaceAll(m.MountPath, "/", "_"))
					if err := os.MkdirAll(dir, 0o700); err != nil {
						t.Fatal(err)
					}
					mounts[m.MountPath] = dir
					for _, v := range spec.Volumes {
						if v.Name != m.Name {
							continue
						}
						switch {
						case v.ConfigMap != nil:
							cm := configMaps[v.ConfigMap.Name]
							if cm == nil {
								t.Errorf("%s %s: ConfigMap %s is not rendered", name, wname, v.ConfigMap.Name)
								continue
							}
							for f, body := range cm.Data {
								if err := os.WriteFile(filepath.Join(dir, f), []byte(body), 0o600); err != nil {
									t.Fatal(err)
								}
							}
						case v.Secret != nil:
							for _, f := range []string{"auth.conf", "route.secret", "admin.creds", "creds", "authd.creds", "authd-signing.nk"} {
								if err := os.WriteFile(filepath.Join(dir, f), []byte("placeholder\n"), 0o600); err != nil {
									t.Fatal(err)
								}
							}
						}
					}
				}
				// Longest mount path first, so that /a/b wins over /a.
				paths := make([]string, 0, len(mounts))
				for p := range mounts {
					paths = append(paths, p)
				}
				sort.Slice(paths, func(i, j int) bool { return len(paths[i]) > len(paths[j]) })
				local := func(s string) string {
					for _, p := range paths {
						if i := strings.Index(s, p); i >= 0 {
							return s[:i] + mounts[p] + s[i+len(p):]
						}
					}
					return s
				}
				env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + root}
				vars := map[string]string{}
				for _, e := range ctr.Env {
					v := e.Value
					if e.ValueFrom != nil {
						switch {
						case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.name":
							v = "prod-narwhal-router-7d9f8b6c5d-x2k4q"
						case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "status.podIP":
							v = "10.1.2.3"
						case e.ValueFrom.ResourceFieldRef != nil:
							v = "2"
						default:
							t.Errorf("%s %s %s: env %s from %+v: not handled by this test", name, wname, ctr.Name, e.Name, e.ValueFrom)
						}
					}
					v = envRef.ReplaceAllStringFunc(v, func(r string) string { return vars[r[2:len(r)-1]] })
					vars[e.Name] = v
					env = append(env, e.Name+"="+local(v))
				}
				args := []string{"--check-args"}
				for _, a := range ctr.Args {
					args = append(args, local(envRef.ReplaceAllStringFunc(a, func(r string) string { return vars[r[2:len(r)-1]] })))
				}
				// --check-args goes after the subcommand's name.
				args = append([]string{args[1]}, append([]string{"--check-args"}, args[2:]...)...)
				cmd := exec.Command(narwhalBin, args...)
				cmd.Env = env
				var stderr bytes.Buffer
				cmd.Stderr = &stderr
				if err := cmd.Run(); err != nil {
					t.Errorf("%s %s container %s: narwhal %q: %v: %s", name, wname, ctr.Name, args, err, stderr.String())
				}
				checked++
			}
		}
	}
	if checked < 5 {
		t.Errorf("only %d narwhal containers checked", checked)
	}
}

// TestChartLint proves that Helm's own lint passes with the defaults and
// each example values file, with no warning.
func TestChartLint(t *testing.T) {
	for name, vals := range valueSets(t) {
		l := lint.All(chartDir, vals, namespace, false)
		for _, m := range l.Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("%s: lint: %s", name, m)
			}
		}
	}
}

// TestChartSchemaRejects proves that values.schema.json refuses wrong
// values the way helm install does, with a message naming the value.
func TestChartSchemaRejects(t *testing.T) {
	c := loadChart(t)
	for _, tc := range []struct {
		vals map[string]any
		want string
	}{
		{map[string]any{"bus": map[string]any{"replicas": 2}}, "replicas"},
		{map[string]any{"router": map[string]any{"port": 70000}}, "port"},
		{map[string]any{"router": map[string]any{"replicas": "two"}}, "replicas"},
		{map[string]any{"image": map[string]any{"pullPolicy": "Sometimes"}}, "pullPolicy"},
		{map[string]any{"engines": []any{map[string]any{"name": "p", "role": "producer", "engine": "vllm", "image": "x", "args": []any{}}}}, "role"},
		{map[string]any{"authd": map[string]any{"ttl": "ten minutes"}}, "ttl"},
		{map[string]any{"bus": map[string]any{"external": map[string]any{"url": "http://nats:4222"}}}, "url"},
	} {
		_, err := render(t, c, tc.vals)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("values %v: %v, want a schema error naming %q", tc.vals, err, tc.want)
		}
	}
}

// TestChartBusQuorumAndCredentials proves, for 1, 3 and 5 bus servers,
// that the StatefulSet's --routes name every replica through the headless
// Service, that the PodDisruptionBudget keeps a JetStream quorum
// (minAvailable n/2+1, none for a trial bus of 1), and that no ConfigMap
// holds a credential (behaviour.md R-BUS-8).
func TestChartBusQuorumAndCredentials(t *testing.T) {
	c := loadChart(t)
	cred := regexp.MustCompile(`(?i)(BEGIN NATS|SUAC|SUAA|SOAA|SAA[A-Z2-7]{20,}|eyJ[a-zA-Z0-9_-]{10,}\.|password|BEGIN [A-Z ]*PRIVATE KEY)`)
	for _, n := range []int{1, 3, 5} {
		objs := renderObjects(t, c, map[string]any{"bus": map[string]any{"replicas": n}, "monitoring": map[string]any{"enabled": true}})
		var sts *appsv1.StatefulSet
		var pdb *policyv1.PodDisruptionBudget
		for _, o := range objs {
			switch v := o.obj.(type) {
			case *appsv1.StatefulSet:
				sts = v
			case *policyv1.PodDisruptionBudget:
				pdb = v
			case *corev1.ConfigMap:
				for k, body := range v.Data {
					if m := cred.FindString(body); m != "" {
						t.Errorf("bus %d: ConfigMap %s/%s holds %q, a credential", n, v.Name, k, m)
					}
				}
			}
		}
		if sts == nil || *sts.Spec.Replicas != int32(n) {
			t.Fatalf("bus %d: StatefulSet %+v", n, sts)
		}
		var routes string
		for _, a := range sts.Spec.Template.Spec.Containers[0].Args {
			if r, ok := strings.CutPrefix(a, "--routes="); ok {
				routes = r
			}
		}
		if n == 1 {
			if routes != "" || pdb != nil {
				t.Errorf("bus 1: routes %q, PDB %v; want neither", routes, pdb)
			}
			continue
		}
		var want []string
		for i := range n {
			want = append(want, fmt.Sprintf("nats://%s-%d.%s.%s.svc:6222", sts.Name, i, sts.Spec.ServiceName, namespace))
		}
		if routes != strings.Join(want, ",") {
			t.Errorf("bus %d: --routes %q, want %q", n, routes, strings.Join(want, ","))
		}
		if pdb == nil || pdb.Spec.MinAvailable == nil || pdb.Spec.MinAvailable.IntValue() != n/2+1 {
			t.Errorf("bus %d: PDB %+v, want minAvailable %d", n, pdb, n/2+1)
		}
	}
}

// TestChartAlertsAndDashboardOneSource proves that the chart's copies of
// the alerts and the Grafana dashboard equal deploy/prometheus/alerts.yaml
// and deploy/grafana/narwhal.json (Helm reads no file outside the chart),
// and that the rendered PrometheusRule's rules equal the file's. With
// NARWHAL_UPDATE_CHART=1 it writes the copies first.
func TestChartAlertsAndDashboardOneSource(t *testing.T) {
	for src, dst := range map[string]string{
		"../prometheus/alerts.yaml": "narwhal/files/alerts.yaml",
		"../grafana/narwhal.json":   "narwhal/files/narwhal.json",
	} {
		want, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if os.Getenv("NARWHAL_UPDATE_CHART") == "1" {
			if err := os.WriteFile(dst, want, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if got, _ := os.ReadFile(dst); !bytes.Equal(got, want) {
			t.Errorf("%s differs from %s: run NARWHAL_UPDATE_CHART=1 go test -run TestChartAlertsAndDashboardOneSource", dst, src)
		}
	}
	raw, _ := os.ReadFile("../prometheus/alerts.yaml")
	var file monitoringv1.PrometheusRuleSpec
	if err := yaml.UnmarshalStrict(raw, &file); err != nil {
		t.Fatal(err)
	}
	c := loadChart(t)
	var rule *monitoringv1.PrometheusRule
	for _, o := range renderObjects(t, c, map[string]any{"monitoring": map[string]any{"enabled": true}}) {
		if r, ok := o.obj.(*monitoringv1.PrometheusRule); ok {
			rule = r
		}
	}
	if rule == nil {
		t.Fatal("no PrometheusRule with monitoring.enabled")
	}
	got, _ := yaml.Marshal(rule.Spec)
	want, _ := yaml.Marshal(file)
	if !bytes.Equal(got, want) || len(file.Groups) == 0 || len(file.Groups[0].Rules) == 0 {
		t.Errorf("PrometheusRule spec differs from alerts.yaml:\n%s\nwant\n%s", got, want)
	}
}

// TestChartPortsMatchFlags proves that the ports of probes, Services and
// monitors are the ports the containers' flags listen on.
func TestChartPortsMatchFlags(t *testing.T) {
	c := loadChart(t)
	listenFlag := regexp.MustCompile(`^--(listen|metrics|metrics-addr|cluster)=[^:]*:(\d+)$`)
	for name, vals := range valueSets(t) {
		objs := renderObjects(t, c, vals)
		// named: every container port's name → its number, per workload
		// selector component; and each must be one a flag listens on.
		portsByComponent := map[string]map[string]int32{}
		for _, o := range objs {
			var spec *corev1.PodSpec
			var labels map[string]string
			switch w := o.obj.(type) {
			case *appsv1.Deployment:
				spec, labels = &w.Spec.Template.Spec, w.Spec.Template.Labels
			case *appsv1.StatefulSet:
				spec, labels = &w.Spec.Template.Spec, w.Spec.Template.Labels
			default:
				continue
			}
			for _, ctr := range spec.Containers {
				if len(ctr.Command) == 0 || ctr.Command[0] != "narwhal" {
					continue
				}
				flagPorts := map[string]bool{}
				for _, a := range ctr.Args {
					if m := listenFlag.FindStringSubmatch(a); m != nil {
						flagPorts[m[2]] = true
					}
				}
				named := map[string]int32{}
				for _, p := range ctr.Ports {
					named[p.Name] = p.ContainerPort
					if !flagPorts[fmt.Sprint(p.ContainerPort)] {
						t.Errorf("%s %s/%s: port %s %d is on no flag (%v)", name, o.name, ctr.Name, p.Name, p.ContainerPort, ctr.Args)
					}
				}
				for _, pr := range []*corev1.Probe{ctr.ReadinessProbe, ctr.LivenessProbe, ctr.StartupProbe} {
					if pr == nil {
						continue
					}
					var port string
					switch {
					case pr.HTTPGet != nil:
						port = pr.HTTPGet.Port.String()
					case pr.TCPSocket != nil:
						port = pr.TCPSocket.Port.String()
					}
					if _, ok := named[port]; !ok && !flagPorts[port] {
						t.Errorf("%s %s/%s: probe port %s is not a container port", name, o.name, ctr.Name, port)
					}
				}
				if portsByComponent[labels["app.kubernetes.io/component"]] == nil {
					portsByComponent[labels["app.kubernetes.io/component"]] = map[string]int32{}
				}
				for k, v := range named {
					portsByComponent[labels["app.kubernetes.io/component"]][k] = v
				}
			}
		}
		for _, o := range objs {
			switch v := o.obj.(type) {
			case *corev1.Service:
				ports := portsByComponent[v.Spec.Selector["app.kubernetes.io/component"]]
				for _, p := range v.Spec.Ports {
					if _, ok := ports[p.TargetPort.String()]; !ok {
						t.Errorf("%s Service %s: targetPort %s names no container port (%v)", name, v.Name, p.TargetPort.String(), ports)
					}
				}
			case *monitoringv1.ServiceMonitor:
				ports := portsByComponent[v.Spec.Selector.MatchLabels["app.kubernetes.io/component"]]
				for _, e := range v.Spec.Endpoints {
					if _, ok := ports[e.Port]; !ok {
						t.Errorf("%s ServiceMonitor %s: port %s names no container port", name, v.Name, e.Port)
					}
				}
			case *monitoringv1.PodMonitor:
				ports := portsByComponent[v.Spec.Selector.MatchLabels["app.kubernetes.io/component"]]
				for _, e := range v.Spec.PodMetricsEndpoints {
					if e.Port == nil {
						t.Errorf("%s PodMonitor %s: an endpoint without a port", name, v.Name)
					} else if _, ok := ports[*e.Port]; !ok {
						t.Errorf("%s PodMonitor %s: port %s names no container port", name, v.Name, *e.Port)
					}
				}
			}
		}
	}
}
