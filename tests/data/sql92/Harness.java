import java.io.*;
import java.nio.charset.StandardCharsets;
import java.util.*;
import org.apache.rocketmq.filter.expression.*;
import org.apache.rocketmq.filter.parser.SelectorParser;

/** Reads lines "b64(expr)\tb64(k)\tb64(v)..." and prints PARSE_ERROR | EVAL_ERROR | TRUE | FALSE | NULL | OTHER. */
public class Harness {
    public static void main(String[] args) throws Exception {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        PrintStream out = new PrintStream(new BufferedOutputStream(System.out), false, "UTF-8");
        Base64.Decoder dec = Base64.getDecoder();
        String line;
        while ((line = in.readLine()) != null) {
            String[] parts = line.split("\t", -1);
            String expr = new String(dec.decode(parts[0]), StandardCharsets.UTF_8);
            final Map<String, String> props = new HashMap<>();
            for (int i = 1; i + 1 < parts.length; i += 2) {
                props.put(new String(dec.decode(parts[i]), StandardCharsets.UTF_8), new String(dec.decode(parts[i + 1]), StandardCharsets.UTF_8));
            }
            BooleanExpression e;
            boolean trailing = false;
            try {
                e = SelectorParser.parse(expr);
                ComparisonExpression.CONVERT_STRING_EXPRESSIONS.set(true);
                try {
                    SelectorParser p = new SelectorParser(new StringReader(expr));
                    p.JmsSelector();
                    trailing = p.getToken(1).kind != org.apache.rocketmq.filter.parser.SelectorParserConstants.EOF;
                } finally {
                    ComparisonExpression.CONVERT_STRING_EXPRESSIONS.remove();
                }
            } catch (Throwable t) {
                out.println("PARSE_ERROR");
                continue;
            }
            if (trailing) {
                out.println("TRAILING");
                continue;
            }
            EvaluationContext ctx = new EvaluationContext() {
                public Object get(String name) { return props.get(name); }
                public Map<String, Object> keyValues() { return new HashMap<>(props); }
            };
            try {
                Object r = e.evaluate(ctx);
                out.println(r == null ? "NULL" : r == Boolean.TRUE ? "TRUE" : r == Boolean.FALSE ? "FALSE" : ("OTHER " + r.getClass().getName() + " " + r));
            } catch (Throwable t) {
                out.println("EVAL_ERROR");
            }
        }
        out.flush();
    }
}
